"""The ledger's pure core: the fold of object events into per-namespace state and its checkpoints (``fold``), when
a changed namespace is accounted again (``schedule``) and the usage snapshot it publishes (``usage``)."""
