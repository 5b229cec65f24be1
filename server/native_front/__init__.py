"""The native Forward port (``expertd serve --native-port``): gRPC C++ parses and answers Forward,
Python decides on each call once per batch (``front.py`` says what it serves and what is checked
where; ``build.py`` how it is built)."""
from expertd.server.native_front.build import NativeUnavailable, build_module, load
from expertd.server.native_front.front import NativeFront

__all__ = ["NativeFront", "NativeUnavailable", "build_module", "load"]
