"""The ledger's pure core: the fold of object events into per-namespace state (``fold``) and when a changed
namespace is accounted again (``schedule``)."""
