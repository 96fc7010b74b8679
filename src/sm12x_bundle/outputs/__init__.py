"""Outputs of the pipeline: the patched tree, overlays, the bundle image, Nomad job specs."""
