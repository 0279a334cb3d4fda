"""``python3 -m zoe.consolidate [--scratch-dir DIR] CHECKPOINT_DIR OUT.pt``: a sharded zoe
checkpoint as one torch state dict, without the ranks (the code is zoe/torch/consolidate.py)."""

import sys

from .torch.consolidate import consolidate_checkpoint, consolidated_state_dict, main

__all__ = ["consolidate_checkpoint", "consolidated_state_dict", "main"]

if __name__ == "__main__":
    sys.exit(main())
