"""scripts/dump_tir.py: the MoE programs' TIR dumps are stable from one build to the next (so two commits' dumps can
be compared), and the comparison names a program that changed or is missing."""


def test_moe_dumps_are_stable_and_a_change_is_named(tmp_path, capsys, load_script):
    dump_tir = load_script("dump_tir")
    a, b = tmp_path / "a", tmp_path / "b"
    n = dump_tir.dump(a, ["moe"], ["mp_31"])
    assert n >= 60 and dump_tir.dump(b, ["moe"], ["mp_31"]) == n
    assert dump_tir.compare(a, b) == 0
    victim = sorted(b.glob("*.tir"))[0]
    victim.write_text(victim.read_text().replace("T.gemm", "T.gemm_v2", 1) + "\n")
    gone = sorted(b.glob("*.tir"))[1]
    gone.unlink()
    assert dump_tir.compare(a, b) == 1
    out = capsys.readouterr().out
    assert "differs: # mp_31" in out and "only in" in out and f"{n - 2} of {n} programs identical" in out
