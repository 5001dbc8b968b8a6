"""ChatFormat: pieces of the chat template, and the closing text after a generated turn."""

from __future__ import annotations


def test_pieces_recompose_the_template_rendering(tiny_policy):
    tok, chat = tiny_policy.tokenizer, tiny_policy.chat
    msgs = [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "obs one"},
        {"role": "assistant", "content": "Up"},
        {"role": "user", "content": "obs two"},
    ]
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    head, tail = chat.start("Rules.")
    ids = (
        list(head) + list(chat.encode("obs one")) + list(tail) + list(chat.encode("Up"))
        + [tiny_policy.stop_ids[0]] + list(chat.close_after("Up<|im_end|>"))
        + list(chat.user_head) + list(chat.encode("obs two")) + list(chat.user_tail)
    )
    assert tok.decode(ids) == rendered


def test_close_after_does_not_repeat_a_sampled_stop_token(tiny_policy):
    chat, tok = tiny_policy.chat, tiny_policy.tokenizer
    assert chat.assistant_close == "<|im_end|>\n"
    assert tok.decode(list(chat.close_after("Up<|im_end|>"))) == "\n"
    assert tok.decode(list(chat.close_after("Up"))) == "<|im_end|>\n"  # cut by max_new_tokens: close it


def test_tiny_tokenizer_gives_one_token_per_grid_cell(tiny_policy):
    grid = "######\n#_@$.#\n######"
    ids = tiny_policy.tokenizer(grid, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(grid)
    assert tiny_policy.tokenizer.decode(ids) == grid
