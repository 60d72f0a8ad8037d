"""The one thing pyproject.toml cannot declare: the optional native row copy for the CPU path.

It is built with OpenMP where the compiler has it (its loops then run on torch's OpenMP
threads), else without, else not at all: the package installs without a C compiler and
copies with torch and numpy.
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

OPENMP = ["-fopenmp"]


class BuildRowCopy(build_ext):
    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception:  # any compiler or linker failure: retry without OpenMP
            if OPENMP[0] not in ext.extra_compile_args:
                raise
            self.warn(f"building {ext.name} with OpenMP failed; building it without (copies on one thread)")
            ext.extra_compile_args = [a for a in ext.extra_compile_args if a not in OPENMP]
            ext.extra_link_args = [a for a in ext.extra_link_args if a not in OPENMP]
            super().build_extension(ext)


setup(
    ext_modules=[
        Extension(
            "kvdepot.gpu._rowcopy",
            sources=["src/kvdepot/gpu/_rowcopy.c"],
            extra_compile_args=["-O2", *OPENMP],
            extra_link_args=list(OPENMP),
            optional=True,  # without a compiler the package still installs; copies fall back to torch/numpy
        )
    ],
    cmdclass={"build_ext": BuildRowCopy},
)
