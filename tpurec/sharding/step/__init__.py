"""The training steps in one room: TorchRec's pipeline with SparseCore inputs built after the input
all-to-all (`sparsecore_pipeline.py`, the eager step), the compiled step (`compiled.py`), the pipelined
step (`pipelined.py`; its SparseCore stages on a batch in flight: `pipeline_stages.py`), the dense
optimizer's traceable update (`dense_update.py`; the optimizers and settings it implements:
`dense_supported.py`; torch.optim's arithmetic, traceable: `dense_arithmetic.py`), which batch field
feeds which sharded module (`inputs.py`), and `--step`'s choice behind one interface (`kinds.py`)."""
