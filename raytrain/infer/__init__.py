"""Batch inference on Ray Data: what ``python -m raytrain.predict`` runs.

``model``: the weights, network and eval transform a MODEL path stands for (run directory,
checkpoint, bare model.pt). ``inputs``: the images (or Parquet rows) under --data-dir, listed
once on the driver. ``pipeline``: decode tasks -> an actor pool holding the model -> rows.
``output``: the rows streamed into one Parquet/CSV file, replaced whole at the end.

    spec, weights = model.resolve("runs/my-run")
    found = inputs.list_inputs("s3://bucket/new-images")
    with output.Output("preds.parquet", top_k=1) as out:
        for table in pipeline.predict_batches(spec, weights, found, plan): out.write(table)
"""
