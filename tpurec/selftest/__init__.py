"""`tpurec selftest`: the command (`cli.py`) and the TPU first-contact checklist (`tpu.py`)."""
