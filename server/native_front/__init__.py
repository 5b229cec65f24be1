"""The native Forward port (``expertd serve --native-port``): gRPC C++ serves Forward with no Python
per call (``front.py`` says what it serves; ``build.py`` how it is built)."""
from expertd.server.native_front.build import NativeUnavailable, build_module, load
from expertd.server.native_front.front import NativeFront

__all__ = ["NativeFront", "NativeUnavailable", "build_module", "load"]
