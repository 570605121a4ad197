import pytest

from services.common.speculative_config import SpeculativeConfig
from services.drafter.methods.ngram import NgramProposer
from services.inprocess import default_speculation, local_proposers


def test_parses_the_vllm_shaped_flag():
    config = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
    )
    options = config.options
    assert (config.method, config.num_speculative_tokens, options.prompt_lookup_min, options.prompt_lookup_max) == (
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
        ('{"method": "medusa"}', "unknown speculative method 'medusa'; available: draft_model, eagle, eagle3, ngram, suffix"),
        ('{"method": "ngram", "num_speculative_tokens": -1}', "num_speculative_tokens"),
        ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min"),
        ('{"method": "ngram", "bogus": 1}', r"bogus: not an option of method 'ngram' \(its options: num_draft_tokens, "
                                            r"prompt_lookup_min, prompt_lookup_max\)"),
        ('{"method": "ngram", "suffix_decoding_max_tree_depth": 8}', "not an option of method 'ngram'"),
        ('{"method": "draft_model", "model": "m", "prompt_lookup_max": 3}', r"it has no options"),
        ('{"method": "none", "prompt_lookup_max": 3}', r"not an option of method 'none'"),
        ('{"method": "draft_model", "model": "m", "num_draft_tokens": 8}',
         r"token trees, which method 'draft_model' does not draft \(methods that do: eagle, eagle3, ngram, suffix\)"),
        ('{"method": "suffix", "num_draft_tokens": 65}', "num_draft_tokens"),
        ('{"method": "eagle", "eagle_topk": 2}', "eagle_topk shapes EAGLE's token trees"),
        ('{"method": "eagle", "eagle_sampled_trees": true}', "eagle_sampled_trees shapes EAGLE's token trees"),
        ('{"method": "suffix", "num_draft_tokens": 8, "eagle_topk": 2}', "eagle_topk: not an option of method 'suffix'"),
    ],
)
def test_bad_flags_get_clear_errors(text, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(text)


def test_a_tree_config_verifies_num_draft_tokens_a_step():
    tree = SpeculativeConfig.parse('{"method": "suffix", "num_speculative_tokens": 4, "num_draft_tokens": 12}')
    assert tree.verify_width == 12 and default_speculation(tree).num_speculative_tokens == 12
    assert SpeculativeConfig.parse('{"method": "suffix", "num_speculative_tokens": 4}').verify_width == 4


def test_each_method_reads_its_own_options_with_their_defaults():
    suffix = SpeculativeConfig.parse('{"method": "suffix", "suffix_decoding_min_token_prob": 0.3}').options
    assert (suffix.suffix_decoding_min_token_prob, suffix.suffix_decoding_max_tree_depth) == (0.3, 24)
    assert SpeculativeConfig.parse('{"method": "ngram"}').options.prompt_lookup_max == 4
    eagle = SpeculativeConfig.parse('{"method": "eagle", "num_draft_tokens": 10}')
    assert (eagle.sends_trees, eagle.options.tree_topk, eagle.verify_width) == (True, 4, 10)
    chain = SpeculativeConfig.parse('{"method": "eagle", "num_speculative_tokens": 3}')
    assert (chain.sends_trees, chain.verify_width) == (False, 3)


def test_flag_overrides_choose_the_method_before_its_options_are_checked():
    """The drafter's --method over a JSON that holds only that method's options (as the Helm chart renders it)."""
    config = SpeculativeConfig.parse('{"suffix_decoding_max_tree_depth": 32}', {"method": "suffix"})
    assert (config.method, config.options.suffix_decoding_max_tree_depth) == ("suffix", 32)
    with pytest.raises(ValueError, match="not an option of method 'ngram'"):
        SpeculativeConfig.parse('{"method": "suffix", "suffix_decoding_max_tree_depth": 32}', {"method": "ngram"})
    with pytest.raises(ValueError, match="must be a JSON object"):
        SpeculativeConfig.parse("[1, 2]")
