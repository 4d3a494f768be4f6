"""``probes/train_lora.py`` with the faults planted after ``lorascope attach``
(``--fault rank-conditional-on-trigger``, at the step written in ``$TRAIN_LORA_TRIGGER``).
The job knows nothing of lorascope: started without it, attached from outside::

    TRAIN_LORA_TRIGGER=/tmp/trigger torchrun --nproc_per_node 2 probes/train_lora_attach.py \
        --steps 100000 --print-losses --fault rank-conditional-on-trigger
    lorascope attach --out runs/att --launcher <torchrun's pid>
    echo 40 > /tmp/trigger    # rank 0 alone all_reduces at step 40
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train_lora

if __name__ == "__main__":
    train_lora.add_attach_faults()
    train_lora.lone_process_defaults()
    train_lora.main()
