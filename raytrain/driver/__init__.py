"""Driver side: the Ray cluster (``cluster``), checks before anything starts (``preflight``),
one training run and its directory (``run``), console output (``console``). Never imports the
Tune layer or worker internals other than the entry point it hands to Ray Train."""
