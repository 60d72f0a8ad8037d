"""The one thing pyproject.toml cannot declare: the native CPU copy, a required C extension.

It is built with OpenMP where the compiler has it (its loops then run on torch's OpenMP
threads), else without (copies on one thread). Without a C compiler and the Python headers
the install fails, and says what to install: CPU copies have no other fast path.
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

OPENMP = ["-fopenmp"]

MISSING_COMPILER = (
    "kvdepot-gpu could not build its native CPU copy (kvdepot.gpu._rowcopy, a small C extension "
    "every install needs). Install a C compiler and the Python headers (Debian/Ubuntu: "
    "`apt-get install gcc python3-dev`; Fedora: `dnf install gcc python3-devel`) and install again. "
    "The compiler's own message is above."
)


class BuildRowCopy(build_ext):
    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
            return
        except Exception:  # any compiler or linker failure: retry without OpenMP
            self.warn(f"building {ext.name} with OpenMP failed; building it without (copies on one thread)")
        ext.extra_compile_args = [a for a in ext.extra_compile_args if a not in OPENMP]
        ext.extra_link_args = [a for a in ext.extra_link_args if a not in OPENMP]
        try:
            super().build_extension(ext)
        except Exception as exc:
            raise SystemExit(f"error: {MISSING_COMPILER}") from exc


setup(
    ext_modules=[
        Extension(
            "kvdepot.gpu._rowcopy",
            sources=["src/kvdepot/gpu/_rowcopy.c"],
            extra_compile_args=["-O2", *OPENMP],
            extra_link_args=list(OPENMP),
            optional=False,  # required: the CPU copy path has no fallback but the slow torch reference
        )
    ],
    cmdclass={"build_ext": BuildRowCopy},
)
