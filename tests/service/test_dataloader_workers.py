"""`DataLoader(num_workers=2)` with fork, the default, inside PSTrainer (issue 17, item 2).

A user's script (dataloader_training.py) runs as its own process against a real server process, in
every mode and over every transport. Without pshard's fork handling the loader's workers died with
SIGSEGV within an epoch or two (gRPC restarted its threads in them; pshard.client.forking).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.harness import FINISH_TIMEOUT_S, STARTUP_TIMEOUT_S, Procs

SCRIPT = Path(__file__).with_name("dataloader_training.py")
EPOCHS = 3
STEPS_PER_EPOCH = 6  # 192 samples in batches of 32

CASES = [  # (mode, transport, persistent workers, overlap): each mode, each transport, both lifetimes
    ("sync", "tcp", False, False),
    ("sync", "shm", True, True),
    ("sync", "grpc", False, False),
    ("async", "tcp", True, False),
    ("ssp", "shm", False, False),
]


IDS = ["-".join([m, t, "persistent" if p else "per-epoch", *(["overlap"] if o else [])])
       for m, t, p, o in CASES]


@pytest.mark.parametrize(("mode", "transport", "persistent", "overlap"), CASES, ids=IDS)
def test_dataloader_workers_fork_inside_pstrainer(procs: Procs, monkeypatch: pytest.MonkeyPatch, mode: str,
                                                  transport: str, persistent: bool, overlap: bool) -> None:
    # The script's environment is a user's: nothing set by this test process's own import of pshard.
    monkeypatch.delenv("GRPC_ENABLE_FORK_SUPPORT", raising=False)
    server = procs.python("ps", "-m", "pshard.ps_server", "--bind", "127.0.0.1:0", "--workers", "w0",
                          "--no-scheduler", "--insecure")  # the script's declare sets the mode
    port = server.wait_for_line(r"^pshard ps: listening on port (\d+)", STARTUP_TIMEOUT_S).group(1)
    flags = [*(["--persistent"] if persistent else []), *(["--overlap"] if overlap else [])]
    script = procs.python("script", str(SCRIPT), "--server", f"127.0.0.1:{port}", "--mode", mode,
                          "--transport", transport, *flags)
    code = script.wait(FINISH_TIMEOUT_S)
    assert code == 0, script.output()
    last = script.wait_for_line(rf"epoch {EPOCHS - 1} clock (\d+)", 1).group(1)
    assert int(last) == EPOCHS * STEPS_PER_EPOCH, script.output()
    # The fast path was really in use while the loader forked, and the client refused in the children.
    transports, refusals = script.wait_for_line(r"transports \['(\w+)'\] refusals (\d+)", 1).groups()
    assert transports == transport, script.output()
    assert int(refusals) == EPOCHS, script.output()  # item 0, once an epoch
    assert not any("fork_posix" in line for line in script.lines), script.output()
