"""`specserve demo` end to end on the tiny config: both settings, both strategies, loop shares and the
greedy equality line are printed; bad settings are refused with the parameter named."""
import re

from cluster.cli.main import main


def test_demo_reports_loops_and_greedy_equality(capsys):
    rc = main(["demo", "--config", "configs/tiny.yaml", "--prompts", "2", "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = re.findall(r"^\[(greedy|T=0\.8 top_p=0\.9)\] (\w+): .* a loop \(a 4-gram 3\+ times\): (\d)/2$", out, re.M)
    assert [(s, k) for s, k, _ in rows] == [("greedy", "autoregressive"), ("greedy", "speculative"),
                                           ("T=0.8 top_p=0.9", "autoregressive"),
                                           ("T=0.8 top_p=0.9", "speculative")]
    assert "greedy speculative == greedy autoregressive on 2/2 prompts" in out


def test_demo_rejects_bad_top_p(capsys):
    rc = main(["demo", "--config", "configs/tiny.yaml", "--top-p", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "top_p" in err and "0" in err
