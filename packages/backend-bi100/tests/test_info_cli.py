"""``pagedprefill info --describe`` on Iluvatar parts this backend contributes: bi100 is chosen, and why."""

import pytest
from pagedprefill.cli import main


@pytest.mark.parametrize("name", ["bi-v100", "BI-V150"])
def test_info_on_a_described_iluvatar_part_chooses_bi100(name, monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter would veto every GPU
    assert main(["info", "--describe", name]) == 0
    out = capsys.readouterr().out
    assert "vendor=iluvatar" in out
    assert "choice: bi100 (priority 200)" in out
    assert "needs an NVIDIA GPU, the device's vendor is 'iluvatar'" in out  # why sm80 was not chosen


def test_info_on_a_described_v100_does_not_choose_bi100(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["info", "--describe", "v100"]) == 0
    out = capsys.readouterr().out
    assert "choice: generic" in out
    assert "bi100" in out and "vendor 'nvidia'" in out
