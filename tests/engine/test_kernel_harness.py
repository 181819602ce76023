"""The native kernels under a C stress harness (``kernels/kernel_harness.c``):
built with AddressSanitizer + UndefinedBehaviorSanitizer, and with the
production flags (also as for CPUs without AVX-512 and without AVX2), then run
on random shapes, schedules and dtypes (see the harness's header). Needs the C
compiler the engine builds its kernels with (CI installs it, ``.ci/run``);
without one these tests fail, like the other native-kernel tests, rather than
skip.

The four builds are single-threaded compiles (~20 s of one core together
here): the module starts them side by side at its first test, so that a
2-core machine compiles two at a time, and each test waits for its own."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from services.engine.torch_backend.native import CFLAGS, KERNELS, SOURCES

HARNESS = Path(__file__).with_name("kernels") / "kernel_harness.c"
COMPILER = os.environ.get("CC", "cc")
SANITIZE = ("-O1", "-g", "-fsanitize=address,undefined,float-cast-overflow",
            "-fno-sanitize-recover=undefined,float-cast-overflow",
            "-fno-omit-frame-pointer")
#: The production flags less those of a shared library and those build() adds.
PRODUCTION = tuple(f for f in CFLAGS if f not in ("-shared", "-fPIC", "-march=native",
                                                  "-fopenmp", "-std=gnu11"))
X86 = platform.machine() in ("x86_64", "AMD64")
#: Each ISA path of int_matmul.c below VNNI: its flags, a macro the build must
#: define and one it must not.
OLDER_ISAS = {
    # CPUs with AVX2 but no AVX-512 (AMD Zen 1-3, Intel before Ice Lake): vpmaddwd.
    "avx2": (("-mno-avx512f",), "__AVX2__", "__AVX512F__"),
    # Neither: the portable loops.
    "portable": (("-mno-avx2",), "__SSE2__", "__AVX2__"),
}
#: Every harness binary of the module by name: its compiler flags.
BUILDS = {"harness_asan": SANITIZE, "harness_opt": PRODUCTION,
          **({f"harness_{path}": PRODUCTION + disable
              for path, (disable, _, _) in OLDER_ISAS.items()} if X86 else {})}


def build(folder: Path, name: str, flags: tuple[str, ...]) -> Path:
    binary = folder / name
    done = subprocess.run(
        [COMPILER, *flags, "-march=native", "-fopenmp", "-std=gnu11", f"-I{KERNELS}",
         "-o", str(binary), str(HARNESS), *(str(source) for source in SOURCES), "-lm"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return binary


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Path]]]:
    """Every binary of :data:`BUILDS`, compiling side by side (one per CPU)."""
    if shutil.which(COMPILER) is None:
        pytest.fail(f"no C compiler {COMPILER!r}: apt-get install gcc libc6-dev (or set CC)")
    folder = tmp_path_factory.mktemp("harness")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        yield {name: pool.submit(build, folder, name, flags) for name, flags in BUILDS.items()}


def run(binary: Path, *args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "ASAN_OPTIONS": "detect_leaks=0",
           "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}
    done = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=600,
                          env=env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert f"{args[0]}: OK (0 failures)" in output, output[-4000:]
    return output


@pytest.fixture(scope="module")
def sanitized(builds: dict[str, Future[Path]]) -> Path:
    return builds["harness_asan"].result()


@pytest.mark.parametrize("args", [
    ("edge", "1", "1"),
    ("bad_group_nondiv", "1", "1"),
    ("bad_group_zero", "1", "1"),
    ("attn", "11", "30", "300", "40", "1e8", "3"),
    ("attn", "12", "6", "200", "30", "1e8", "2", "32"),  # 32 query heads per KV head
    ("fused", "14", "100"),
    ("intmm", "15", "150"),
])
def test_kernels_under_sanitizers(sanitized: Path, args: tuple[str, ...]) -> None:
    run(sanitized, *args)


def test_kernels_with_production_flags(builds: dict[str, Future[Path]]) -> None:
    optimized = builds["harness_opt"].result()
    output = run(optimized, "attn", "21", "60", "600", "70", "3e8", "4")
    assert "max |err| fp32 out vs double ref" in output
    run(optimized, "fused", "22", "300")
    output = run(optimized, "intmm", "23", "300")
    assert "outputs bit-identical to the scalar reference" in output


@pytest.mark.skipif(not X86, reason="-mno-avx512f / -mno-avx2 are x86 flags")
@pytest.mark.parametrize("path", list(OLDER_ISAS))
def test_int_matmul_without_vnni(builds: dict[str, Future[Path]], path: str) -> None:
    """int_matmul.c built as for a CPU without AVX512-VNNI (its AVX2 path, or
    its portable loops): the same bits as the scalar reference, hence as the
    VNNI path."""
    disable, present, absent = OLDER_ISAS[path]
    binary = builds[f"harness_{path}"].result()
    macros = subprocess.run([COMPILER, *PRODUCTION, *disable, "-march=native", "-dM", "-E",
                             "-x", "c", os.devnull],
                            capture_output=True, text=True, timeout=60).stdout
    assert f"#define {present} " in macros and f"#define {absent} " not in macros, path
    output = run(binary, "intmm", "24", "200")
    assert "outputs bit-identical to the scalar reference" in output
