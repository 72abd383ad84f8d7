"""An op TorchTPU 0.2.0 has no kernel for, called from the user's code on the emulated device: one line
naming the op, the user's file:line and what to do instead (issue 63 item 2), not a traceback per rank.

The device renames PrivateUse1 for the whole process: the probe runs in a fresh interpreter made an
emulated rank (TPUREC_EMULATE_TPU set before `import tpurec`), and prints what it saw as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

USER_CODE = textwrap.dedent(
    """
    import torch
    from torchrec import JaggedTensor


    def padded(values, lengths):
        jt = JaggedTensor(values=values, lengths=lengths)
        return jt.to_padded_dense(desired_length=3)


    def unique_rows(x):
        return torch.unique(x, dim=0)
    """
)

PROBE = textwrap.dedent(
    """
    import json, sys, torch
    import tpurec  # an emulated rank: the device is installed here
    from tpurec.errors import UserError
    sys.path.insert(0, sys.argv[1])
    import user_code

    seen = {}
    values = torch.ones(5, 4).to("tpu")
    lengths = torch.tensor([2, 3]).to("tpu")
    for name, call in (
        ("padded", lambda: user_code.padded(values, lengths)),
        ("unique", lambda: user_code.unique_rows(values)),
    ):
        try:
            call()
            seen[name] = None
        except NotImplementedError as e:
            seen[name] = {"user_error": isinstance(e, UserError), "message": str(e)}
    print(json.dumps(seen))
    """
)


def _probe(tmp_path: Path) -> dict:
    (tmp_path / "user_code.py").write_text(USER_CODE)
    env = dict(os.environ, TPUREC_EMULATE_TPU="v5p-8", LOCAL_RANK="0", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True, text=True, cwd=REPO, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_op_torchtpu_lacks_in_user_code_is_one_line_naming_it_and_the_users_line(tmp_path):
    seen = _probe(tmp_path)
    user_file = tmp_path / "user_code.py"
    padded, unique = seen["padded"], seen["unique"]
    # a UserError (the rank prints it as one line, once for the ranks: tpurec/runtime/rank_errors.py)
    assert padded["user_error"] and unique["user_error"], seen
    said = padded["message"]
    assert "\n" not in said, said
    assert said.startswith(f"{user_file}:8: JaggedTensor.to_padded_dense calls fbgemm::jagged_to_padded_dense"), said
    assert "has no TorchTPU 0.2.0 kernel" in said and "docs/sequence.md" in said, said
    assert "offsets()" in said, said  # the alternative: gather the rows by offsets
    # an op called directly is named by itself, with the user's line
    assert unique["message"].startswith(f"{user_file}:12: aten::unique_dim has no TorchTPU 0.2.0 kernel"), unique
