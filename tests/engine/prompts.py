"""Token ids of SmolLM2-135M-Instruct prompts, tokenized once with its GGUF tokenizer
(``AutoTokenizer.from_pretrained(dir, gguf_file=name)``) so tests need no tokenizer."""

#: "The quick brown fox jumps over the lazy dog. Once upon a time, in a small
#: village by the sea," (23 tokens).
STORY = (504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 4027, 1980, 253, 655, 28,
         281, 253, 1165, 6560, 411, 260, 3426, 28)

#: The chat template (with its default system prompt) around "What is the capital
#: of France? Answer in one sentence.", generation prompt added (42 tokens).
CHAT = (1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018,
        411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47,
        19842, 281, 582, 6330, 30, 2, 198, 1, 520, 9531, 198)

#: Greedy answer to CHAT: "The capital of France is Paris." then <|im_end|> (EOS, id 2).
CHAT_GREEDY = (504, 3575, 282, 4649, 314, 7042, 30, 2)

EOS = 2
