"""Runtimes: the micro-VM (``vm``) and the namespace sandbox (``namespace``)."""
