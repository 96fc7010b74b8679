# sm12x-bundle: builds vLLM's cumem extension alone, against the base image's own
# Python and CUDA headers, linking the CUDA driver stub. Never a full vLLM build.
#
# A template: `sm12x-bundle image` fills in the fields between @ signs and writes
# the result into a build context of its own (csrc/: the patched source and its
# headers; lib/: the tool's native.py). The rendered file builds with BuildKit
# (`docker build`, Docker 23 and later) and with the classic builder the Docker SDK
# drives: no RUN --mount, no heredocs, and FROM names an image, never a bare id (a
# checked image by the local tag sm12x-bundle-pin:<its id without sha256:>).
#
# The compiler line is sm12x_bundle.native's, the same one the GPU selftest runs;
# the base's python3 runs it, so Python.h is the base's own. Both outputs build here
# whenever a daemon and a real image are involved (sm12x_bundle/outputs/native_build.py):
# the bundle image (FROM its base) and the overlay of an image target (FROM that image).
# readelf and nm leave what the result links and needs beside it (out/*.txt), so the
# tool checks that it links libcuda.so.1 without binutils on the host.
FROM @BUILDER_BASE@
@BUILDER_SETUP@
COPY . /sm12x-build/
RUN cd /sm12x-build && CUDA_HOME=@CUDA_HOME@ PYTHONPATH=lib python3 -c "from pathlib import Path; from sm12x_bundle.native import build_cumem_extension as build; print(build(Path('.'), Path('out')))" && readelf -d out/cumem_allocator.abi3.so > out/readelf.txt && nm -D --undefined-only out/cumem_allocator.abi3.so > out/nm.txt
