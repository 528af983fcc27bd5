"""The version matrix: the CPU conformance lane on every release of sglang and speculators under test
(matrix.py; `make version-matrix`, `make version-lane RELEASE=sglang==0.5.22`)."""
