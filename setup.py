"""The one compiled part: controlplane/imaging/_jpegrows.c (libjpeg's scanline API), optional.

Built where libjpeg's headers are installed (Debian: libjpeg62-turbo-dev); where they are
not, the build goes on without it and the intake decodes and encodes whole pictures with
simplejpeg (controlplane/imaging/rows.py says which is in use). Everything else is in
pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "controlplane.imaging._jpegrows",
    sources=["controlplane/imaging/_jpegrows.c"],
    libraries=["jpeg"],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"],
    optional=True,
)])
