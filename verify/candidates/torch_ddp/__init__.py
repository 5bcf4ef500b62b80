"""torch's own ``DistributedDataParallel`` as a candidate (``torch-ddp``): see ``candidate``."""
