"""The one thing pyproject.toml cannot declare: the optional native row copy for the CPU path."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvdepot.gpu._rowcopy",
            sources=["src/kvdepot/gpu/_rowcopy.c"],
            extra_compile_args=["-O2"],
            optional=True,  # without a compiler the package still installs; copies fall back to torch/numpy
        )
    ]
)
