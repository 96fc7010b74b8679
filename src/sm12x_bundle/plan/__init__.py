"""The image-side plan: what one target needs from one lane, computed once.

``files.py`` says which files a series installs and patches an image's own copies;
``native.py`` says which native artifacts are rebuilt and where; ``target.py`` reads a
target (its image, or the pinned tree standing in for it), chooses its lane by the vLLM
version it carries, and returns one :class:`~.target.TargetPlan`, which ``overlay``,
``image`` and ``build`` only render. Nothing here writes an output.
"""
