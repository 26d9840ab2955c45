"""relaytune in a real Jupyter kernel (nbclient + ipykernel): a cell trains the tiny model, the
kernel is interrupted mid-run (SIGINT, as "interrupt kernel" sends), the cell prints the committed
checkpoint from `StoppedEarly`, and re-running the cell continues to the end. The progress bar
must be the notebook widget or clean text, never escape-code soup."""

from __future__ import annotations

import copy
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import nbclient
import nbformat
from conftest import ONE_THREAD_ENV, chat_rows, make_config, step_records, write_jsonl
from jupyter_client.manager import KernelManager

from relaytune import atomic
from relaytune.faults import SESSION_VARIABLES

MAX_STEPS = 40
SLOW_STEP = 0.3


def kernelspec(root: Path) -> Path:
    """A `python3` kernelspec that starts this interpreter (the venv's ipykernel), for JUPYTER_PATH:
    it wins over any user or system-wide `python3` kernel."""
    spec = root / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "relaytune test (venv)", "language": "python"}))
    return root


def notebook(config_yaml: str):
    v4 = nbformat.v4
    setup = "\n".join([
        "import os",
        f"os.environ['RELAYTUNE_SLOW_STEP'] = {str(SLOW_STEP)!r}  # before relaytune is imported",
        *(f"os.environ[{k!r}] = {v!r}" for k, v in ONE_THREAD_ENV.items()),
        "from pathlib import Path",
        f"Path('config.yaml').write_text({config_yaml!r})",
        "cfg = 'config.yaml'",
        "import importlib.util",
        "print('ipywidgets:', importlib.util.find_spec('ipywidgets') is not None)",
    ])
    train = "\n".join([
        "import relaytune",
        "from relaytune.errors import StoppedEarly",
        "try:",
        "    relaytune.train(cfg)",
        "    print('FINISHED')",
        "except StoppedEarly as e:",
        "    print('STOPPED', e.checkpoint)",
    ])
    fast = "os.environ.pop('RELAYTUNE_SLOW_STEP', None)"
    nb = v4.new_notebook(cells=[v4.new_code_cell(setup), v4.new_code_cell(train), v4.new_code_cell(fast)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.validate(nb)
    return nb


def committed_checkpoint(run: Path) -> Path | None:
    folder = run / "checkpoints"
    if not folder.is_dir():
        return None
    for c in sorted(folder.glob("step-*")):
        if atomic.verify(c) is None:
            return c
    return None


def interrupt_after_checkpoint(km, run: Path, fired: dict, timeout: float = 240) -> threading.Thread:
    """A watcher: once a checkpoint is committed, interrupt the kernel (SIGINT), as a user would."""
    def watch():
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if committed_checkpoint(run) is not None:
                fired["at"] = time.monotonic()
                km.interrupt_kernel()
                return
            time.sleep(0.1)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def texts(outputs) -> list[str]:
    """Every piece of text a cell showed: streams, text/plain and error tracebacks."""
    out = []
    for o in outputs:
        if o.get("output_type") == "stream":
            out.append(o["text"])
        elif o.get("output_type") == "error":
            out.extend(o.get("traceback", []))
        else:
            out.extend(v for v in o.get("data", {}).values() if isinstance(v, str))
    return out


def stdout(outputs) -> str:
    return "".join(o["text"] for o in outputs if o.get("output_type") == "stream" and o["name"] == "stdout")


def assert_clean_progress(outputs, widgets: bool) -> str:
    """No ANSI escapes, no hundreds of redrawn bars; the widget when ipywidgets is there, else text."""
    shown = texts(outputs)
    joined = "".join(shown)
    assert "\x1b[" not in joined, f"ANSI escapes in the notebook output:\n{joined[-2000:]!r}"
    assert not re.search(r"\r{2,}", joined)
    redraws = joined.count("\r")
    assert redraws <= 3 * MAX_STEPS, f"{redraws} carriage-return redraws: bar soup"
    widget = [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    if widgets:
        assert widget, "ipywidgets is installed but tqdm.auto did not show the notebook widget"
        return "widget"
    assert not widget
    bars = [line for chunk in shown for line in re.split(r"[\r\n]", chunk) if line.startswith("train:")]
    assert bars, f"no text progress bar:\n{joined[-2000:]}"
    assert all(len(line) < 200 for line in bars)
    return "text"


def test_interrupt_kernel_stops_with_a_checkpoint_and_rerun_continues(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("JUPYTER_PATH", str(kernelspec(tmp_path / "jupyter")))
    for k in [k for k in os.environ if k.startswith("RELAYTUNE_") and k not in SESSION_VARIABLES]:
        monkeypatch.delenv(k)
    work = tmp_path / "work"
    data = write_jsonl(tmp_path / "data.jsonl", chat_rows(80))
    cfg = make_config(work, tiny_model, data, max_steps=MAX_STEPS, save_steps=5, logging_steps=1)
    run = work / "run"

    nb = notebook(cfg.read_text(encoding="utf-8"))
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", kernel_manager_class=KernelManager,
                                     resources={"metadata": {"path": str(work)}})
    with client.setup_kernel():
        assert Path(client.km.kernel_spec.argv[0]) == Path(sys.executable)
        client.execute_cell(nb.cells[0], 0)
        widgets = "ipywidgets: True" in "".join(texts(nb.cells[0].outputs))

        fired: dict = {}
        watcher = interrupt_after_checkpoint(client.km, run, fired)
        t0 = time.monotonic()
        client.execute_cell(nb.cells[1], 1)
        first = copy.deepcopy(nb.cells[1].outputs)
        watcher.join(timeout=5)
        first_s = time.monotonic() - t0
        shown = "".join(texts(first))
        assert "at" in fired, "no checkpoint was committed to interrupt after"
        stopped = re.search(r"^STOPPED (\S+)$", stdout(first), re.M)
        assert stopped, f"the cell did not print STOPPED:\n{shown[-3000:]}"
        ckpt = Path(stopped.group(1))
        assert ckpt.is_dir() and ckpt.parent == run / "checkpoints" and atomic.verify(ckpt) is None
        stopped_at = int(ckpt.name.removeprefix("step-"))
        assert 0 < stopped_at < MAX_STEPS
        assert not (run / "final").exists()
        assert "KeyboardInterrupt" not in shown
        kind = assert_clean_progress(first, widgets)

        client.execute_cell(nb.cells[2], 2)  # the slow-step switch off: the rest runs at full speed
        client.execute_cell(nb.cells[1], 1)  # re-run the training cell
        second = nb.cells[1].outputs
        shown2 = "".join(texts(second))
        assert stdout(second) == "FINISHED\n", shown2[-3000:]
        assert f"continuing from {ckpt.name}" in shown2
        assert_clean_progress(second, widgets)

    steps = [r["step"] for r in step_records(run / "metrics.jsonl")]
    assert steps == list(range(steps[0], steps[0] + MAX_STEPS)), steps  # continued: no gap, no duplicate
    assert (run / "final").is_dir() and atomic.verify(run / "final") is None
    print(f"\nprogress bar: {kind}; first run {first_s:.1f}s, stopped at step {stopped_at}")

