"""The query path: a front end's request (`request`) laid out over an index (`layout`), its caches fused
and the answer decoded (`generator`), with what answering produces (`answers`); an agent's relevance checks
over the same caches (`relevance`) and one shared prompt for its two steps (`agent`)."""
