"""Worker side: what runs on every Ray Train worker (or under torchrun, through the face
``raytrain.loop``). Never imports driver, Tune or CLI code."""
