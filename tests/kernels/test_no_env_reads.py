"""kernels/ reads no env variables: every setting is an argument (the native CPU build's come through
`cpu.configure`), so the library behaves the same whatever the process's environment holds."""
import pathlib
import re

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "kernels"
# Python's os.environ / os.getenv / os.environb and C's getenv / secure_getenv / environ.
READS = re.compile(r"environ|getenv")


def test_no_python_or_cpp_source_in_kernels_reads_the_environment():
    sources = [p for p in KERNELS.rglob("*") if p.suffix in (".py", ".cc", ".h", ".cpp", ".hpp")]
    assert any(p.suffix == ".py" for p in sources) and any(p.suffix == ".cc" for p in sources)
    found = [f"{p.relative_to(KERNELS)}:{n}: {line.strip()}" for p in sources
             for n, line in enumerate(p.read_text().splitlines(), 1) if READS.search(line)]
    assert not found, "environment reads in kernels/:\n" + "\n".join(found)
