"""The parts a `tpurec.dlrm.trainer.Trainer` is made of, one job each: the rank's run (`rank_run.py`),
the emulation's differences (`emulation.py`), the data (`data.py`), the sharded model (`model.py`),
the step (`step.py`), the evaluation (`evaluation.py`), the checkpoints (`checkpointing.py`), the
progress lines and records (`progress.py`), the result (`reporting.py`) and the files written beside
it (`side_outputs.py`)."""
