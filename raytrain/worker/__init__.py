"""Worker side: what runs on every Ray Train worker (or under torchrun). Never imports driver,
Tune or CLI code (``local`` alone takes the CLI's parser, for its own flags)."""
