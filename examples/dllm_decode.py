"""Fast-dLLM vs BlockBatch on the shipped diffusion LM, through `model.generate(custom_generate=...)`.

    python examples/dllm_decode.py
"""

from transformers import AutoModel, AutoTokenizer

from hf_dscale.generation import dllm_generate
from hf_dscale.training.dllm_tasks import final_answer, make_problems

folder = "model_cards/hf-dscale-dlm-arithmetic"
model = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
tokenizer = AutoTokenizer.from_pretrained(folder)
problem = make_problems("arithmetic", 1, seed=2024, heldout=True)[0]
ids = tokenizer("[BOS] " + problem.prompt, return_tensors="pt").input_ids
print(problem.prompt)
for method in ("fast-dllm", "blockbatch"):
    stats = []
    out = model.generate(ids, max_new_tokens=model.config.gen_length, do_sample=False, custom_generate=dllm_generate,
                         dllm_method=method, dllm_stats=stats)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    print(f"{method}: {stats[0].nfe} forwards, answer {final_answer(text)} (expected {problem.answer})")
