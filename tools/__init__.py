"""Developer tools of the repository: outside the ``segkv`` package and its wheel, run from the
repository root (``python -m tools.<package>.<module>``)."""
