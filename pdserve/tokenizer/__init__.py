"""Text <-> token ids, shared by the router and the offline ``LLM``: chat
templates (``chat``) and incremental detokenizing with stop strings
(``detokenizer``). No torch here."""
