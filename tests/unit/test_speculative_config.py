import pytest

from services.common.speculative_config import SpeculativeConfig
from services.drafter.methods.ngram import NgramProposer
from services.inprocess import default_speculation, local_proposers


def test_parses_the_vllm_shaped_flag():
    config = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
    )
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (
        "ngram", 5, 2, 5,
    )
    proposers = local_proposers(config)
    assert isinstance(proposers["ngram"], NgramProposer)
    assert proposers["ngram"].settings.prompt_lookup_min == 2
    spec = default_speculation(config)
    assert (spec.method, spec.num_speculative_tokens, spec.enabled) == ("ngram", 5, True)


def test_empty_flag_means_no_speculation():
    config = SpeculativeConfig.parse(None)
    assert not config.enabled
    assert local_proposers(config) == {}
    assert not default_speculation(config).enabled


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"method": "medusa"}', "unknown speculative method 'medusa'; available: draft_model, eagle, ngram, suffix"),
        ('{"method": "ngram", "num_speculative_tokens": -1}', "num_speculative_tokens"),
        ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min"),
        ('{"method": "ngram", "bogus": 1}', "bogus"),
    ],
)
def test_bad_flags_get_clear_errors(text, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(text)
