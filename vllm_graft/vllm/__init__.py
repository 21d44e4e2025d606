"""The vLLM adapter layer: the only part of vllm-graft that imports vLLM.

``plugin.register`` is the ``vllm.general_plugins`` entry point; ``patches`` lists every
vLLM symbol that Graft changes.
"""
