"""bench/llama_cpp_ref.py's rules with a stand-in for llama_cpp.Llama (the real binding is an optional install):
every sequence starts from an empty context and runs exactly its asked length, whatever EOS would say."""

import itertools

from bench import llama_cpp_ref


class FakeLlama:
    """Records what the adapter asks of llama-cpp-python's Llama; generate() never ends by itself."""

    def __init__(self):
        self.resets = 0
        self.prompts: list[list[int]] = []
        self.produced: list[int] = []

    def reset(self) -> None:
        self.resets += 1

    def generate(self, tokens, top_k, temp, reset):
        assert (top_k, temp, reset) == (1, 0.0, True)  # greedy, from the start of `tokens`
        self.prompts.append(list(tokens))
        self.produced.append(0)
        for token in itertools.count():
            self.produced[-1] += 1
            yield token


def test_each_sequence_starts_empty_and_runs_exactly_its_output_length():
    llm = FakeLlama()
    workload = [([5, 6, 7], 4), ([5, 6, 7], 1), ([9], 3)]
    _, tokens = llama_cpp_ref.run_workload(llm, workload)
    assert tokens == 8
    assert llm.resets == 3  # a repeated prompt is recomputed, never served from the previous call's context
    assert llm.prompts == [[5, 6, 7], [5, 6, 7], [9]]
    assert llm.produced == [4, 1, 3]


def test_decode_timing_runs_a_warm_up_a_first_token_and_the_full_length():
    llm = FakeLlama()
    llama_cpp_ref.decode_ms(llm, [1, 2], new_tokens=6)
    assert llm.produced == [2, 1, 6] and llm.resets == 3
