"""YAML 1.1 in job files: accept what users write (`on:` as a key, `off` as a value)."""

from supervisor.intake.jobspec import parse_job_text


def test_on_as_a_key_is_the_word_and_off_as_a_value_is_false():
    """Seen: the README's own example (`notify: [{..., on: [failed]}]`) was refused with
    'Keys should be strings', because YAML 1.1 reads the key `on` as True."""
    spec = parse_job_text("supervisor:\n  command: [x]\n"
                          "  notify: [{command: [notify-send, training], on: [failed, succeeded]}]\n"
                          "  stop_on_fatal_line: off\n")
    assert spec.sup.notify[0].on == ["failed", "succeeded"]
    assert spec.sup.stop_on_fatal_line is False


def test_true_and_false_keys_stay_booleans_and_are_refused_as_keys():
    import pytest

    from supervisor.intake.jobspec import JobFileError

    with pytest.raises(JobFileError):
        parse_job_text("true: 1\nsupervisor: {command: [x]}\n")
