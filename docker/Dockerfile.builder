# sm12x-bundle: builds vLLM's cumem extension alone, against the base image's own
# Python and CUDA headers, linking the CUDA driver stub. Never a full vLLM build.
#
# A template: `sm12x-bundle image` fills in the fields between @ signs and writes
# the result into a build context of its own (csrc/: the patched source and its
# headers; lib/: the tool's native.py). The rendered file builds with plain
# `docker build` and with the classic builder the Docker SDK drives: no RUN --mount,
# no heredocs.
#
# The compiler line is sm12x_bundle.native's, the same one the GPU selftest and the
# overlay builder run; the base's python3 runs it, so Python.h is the base's own.
FROM @BUILDER_BASE@
@BUILDER_SETUP@
COPY . /sm12x-build/
RUN cd /sm12x-build && CUDA_HOME=@CUDA_HOME@ PYTHONPATH=lib python3 -c "from pathlib import Path; from sm12x_bundle.native import build_cumem_extension as build; print(build(Path('.'), Path('out')))"
