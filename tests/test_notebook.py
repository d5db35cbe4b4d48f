"""The volunteer notebook (peers/volunteer.ipynb), executed cell by cell with nbclient against a loopback coordinator,
as a Colab or Kaggle user would run it."""

import re

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from conftest import ROOT, start_coordinator

NOTEBOOK = ROOT / "peers" / "volunteer.ipynb"


def _run(join_command: str, extra_args: list[str], tmp_path) -> nbformat.NotebookNode:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    [parameters] = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]
    parameters.source = f"JOIN_COMMAND = {join_command!r}\nNAME = 'notebook'\nEXTRA_ARGS = {extra_args!r}"
    client = NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()
    finally:
        nbformat.write(notebook, tmp_path / "executed.ipynb")  # for a look after a failure
    return notebook


def _text(notebook: nbformat.NotebookNode) -> str:
    return "\n".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                     for output in cell.get("outputs", []))


def test_notebook_joins_the_run(spawn, tmp_path):
    source = "git+https://example.org/hivetrain.git@v1"
    coordinator, addresses = start_coordinator(spawn, tmp_path, "--preset", "demo", "--package-source", source)
    # what a volunteer's fresh machine installs, as a pip line and as the notebook's first cell takes it
    coordinator.wait_for(rf"^  pip install {re.escape(source)}$", timeout=5)
    coordinator.wait_for(rf"HIVETRAIN_SOURCE = '{re.escape(source)}'\)$", timeout=5)
    # Options pasted with the command reach the peer (a private run's --token did not: the notebook kept only the
    # addresses); here --stop-at-epoch, without which the peer would train on.
    join_command = "python peers/join.py --initial-peers " + " ".join(addresses) + " --stop-at-epoch 3"
    notebook = _run(join_command, ["--host", "127.0.0.1", "--threads", "1"], tmp_path)
    text = _text(notebook)
    assert f"{addresses[0]}: reachable" in text and "With: --stop-at-epoch 3" in text
    assert "Starting at swarm epoch 0" in text and "swarm epoch 3 |" in text and "Left the run." in text


def test_notebook_explains_an_unreachable_coordinator(tmp_path):
    from s3server import free_ports

    closed = f"/ip4/127.0.0.1/tcp/{free_ports(1)[0]}/p2p/QmPvRCVMx1ta4Dzn6fqTNXNjong7wbDRiwKgjtUMPT4UTx"
    with pytest.raises(CellExecutionError, match="no coordinator address is reachable"):
        _run(f"python peers/join.py --initial-peers {closed}", [], tmp_path)
    text = _text(nbformat.read(tmp_path / "executed.ipynb", as_version=4))
    assert "a loopback address only works on the coordinator's own machine" in text
