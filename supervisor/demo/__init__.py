"""A tiny, fully local model + dataset for the end-to-end demo and the real-training tests.

Nothing here comes from a model hub: the tokenizer is trained on generated text and the
model has random weights, so the demo runs offline on a CPU in seconds. The builder lives in
`supervisor.demo.assets` (imported on demand: it pulls in torch/transformers when it builds).
"""
