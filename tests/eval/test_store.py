from oscarkv.eval.store import ResultStore, fingerprint, latest_run, read_jsonl


def test_store_resume_and_fingerprint(tmp_path):
    st = ResultStore(tmp_path)
    p = st.path("m/odel", "data.txt", "oscar", "lm", 512)
    assert p.parent.parent.parent.name == "m_odel"
    run = fingerprint({"a": 1})
    assert run == fingerprint({"a": 1}) and run != fingerprint({"a": 2})
    st.append(p, {"key": "w0", "run": run, "x": 1})
    st.append(p, {"key": "w1", "run": "other", "x": 2})
    assert st.done(p, run) == {"w0"}
    with open(p, "a") as f:
        f.write('{"key": "w2", "run": "' + run + '", "x"')  # torn write
    assert [r["key"] for r in read_jsonl(p)] == ["w0", "w1"]


def test_latest_run_keeps_last_fingerprint_and_dedups():
    recs = [{"key": "a", "run": "1", "v": 0}, {"key": "a", "run": "2", "v": 1}, {"key": "a", "run": "2", "v": 2}]
    assert latest_run(recs) == [{"key": "a", "run": "2", "v": 2}]


def test_recommend_calib_tokens_and_shift():
    from oscarkv.eval.studies import recommend

    text = recommend("calib-tokens", {500: 0.2, 2000: 0.105, 8000: 0.1, 32000: 0.099})
    assert "at least 2000 tokens" in text
    text = recommend("shift", {"shakespeare": 0.1, "kjv": 0.3})
    assert "on shakespeare" in text and "3.00x" in text
