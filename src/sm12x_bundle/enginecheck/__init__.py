"""The engine check: vLLM's own engine, and vLLM's own allocator tests, on this node's GPU.

payload.py gets vLLM onto a GPU machine that has no network; upstream.py runs the
allocator tests of each lane's pinned sdist against pristine and patched trees.
"""
