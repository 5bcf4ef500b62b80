"""torch's FSDP2 (``fully_shard``) as a candidate (``torch-fsdp2``): see ``candidate``."""
