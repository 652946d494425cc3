"""``capture-proxy train``: closed-loop GRPO through the capture proxy on this machine.

``config`` (one frozen settings record, a JSON config file + flags), ``reward`` (the toy task),
``episodes`` (one iteration's group through the proxy), ``weights`` (delivering the learner's
weights to the serving engine, with the proxy's gate), ``policy`` (the learner that stays alive:
in process, or one Ray Train run for the whole loop), ``report`` (iterations.jsonl, the reward
curve, the live display), ``loop`` (the iterations, resumable).
"""
