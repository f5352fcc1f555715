"""The OpenAI Batch API in the gateway process (docs/batch.md): files on a directory every gateway shares
(files.FileStore), batch state and the work queue in a Redis of their own (store.BatchStore: append-only, never
evicting), and runners in every gateway (runner.BatchRunner) that send the lines through the interactive path in the
batch class, beneath interactive traffic; routes.py mounts `/v1/files` and `/v1/batches`."""
