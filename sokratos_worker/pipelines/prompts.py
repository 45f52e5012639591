"""Prompt text of our own, paraphrasing the intent of Sokratos's (behaviour §1.5, §2, §5.4)."""

from __future__ import annotations

from collections.abc import Sequence

CONVERSATION_TRIAGE = """\
You decide which conversation exchanges between a user and their assistant deserve a place in \
the user's long-term memory. Be a ruthless filter: start every score at 0 and raise it only for \
information actually learned about the user or the people in their life.

Score (salience_score, 0 to 10):
- 0-1: noise. Greetings, small talk, weather, "no new emails", status checks, the assistant not \
knowing something.
- 2-3: low or temporary value. News, scheduling, finished tasks, look-ups.
- 4-5: notable. A preference, opinion or plan of the user. Any reaction of the user to content \
the assistant presented, even a single word such as "boring" or "spam", scores at least 4.
- 6-7: identity facts: name, family, where they live, their job.
- 8-10: only life-altering events.
Most exchanges score 0-2. Score what was learned, not how important the topic sounds.
Always 0: metadata about tool use, the content of results of generic requests (news, weather, \
calendar listings), and references to an identity that lack the actual handle or address.
Attribute facts correctly: facts about other people belong to them, and what the assistant \
presented is not the user's interest unless the user reacted to it.

Answer with JSON only:
- salience_score: number from 0 to 10
- summary: one sentence stating what was learned, correctly attributed \
("No new information." when nothing was)
- category: one word such as personal, work, technical, social, health, finance, travel, hobby
- tags: one to three short retrieval tags
- save: true when this is worth keeping long-term
- paradigm_shift: true only for a single life-altering event stated in the exchange (new job, \
marriage, divorce, moving home, a death in the family, a major diagnosis, a new child, \
retirement, an engagement)"""

EMAIL_TRIAGE = """\
You decide which emails deserve a place in the user's long-term memory. Ask: would this still \
matter to the user in ten years? A typical inbox averages about 2.

Score (salience_score, 0 to 10):
- 0-1: marketing, newsletters, shipping notices, password resets, alerts, receipts, renewals, \
billing.
- 2: routine invitations, order confirmations, FYI messages.
- 3-4: active collaborations, project updates, tax documents, travel bookings, conference \
logistics.
- 5: substantive decisions, financial actions, health updates.
- 6-7: job offers, resignations, major financial events, diagnoses, legal matters.
- 8-10: birth, death, marriage, divorce, buying a house, lawsuits.

Answer with JSON only:
- salience_score: number from 0 to 10
- summary: one or two sentences on what the email means for the user
- category: one word such as travel, finance, health, shopping, social, work, marketing, security
- tags: one to three short retrieval tags
- save: true when this is worth keeping long-term
- paradigm_shift: true only when the email reports a life-altering event"""

PREFERENCES_INTRO = (
    "User Preferences (respect them: when an email matches something the user is not "
    "interested in, score it 0 and set save to false):"
)

DISTILLATION = """\
You read an archived stretch of a conversation between a user and their assistant, including \
the tools the assistant called and what they returned, and extract only lasting facts about the \
user.

Keep: what the user says about themselves (job, where they live, family, health, preferences), \
their plans and commitments, their relationships and affiliations, decisions with an ongoing \
effect, strongly held values.
Leave out: small talk, the assistant's advice or reasoning, tools, skills, routines or the fact \
that they exist, preferences guessed only from which tools were used, references to an identity \
without the actual handle or address, plain questions, one-off requests, and any life event the \
user did not state explicitly.
A typical conversation yields zero to three facts. When in doubt, leave it out.

Answer with JSON only: {"facts": [...]}, each fact with
- text: one self-contained statement about the user
- salience: 5 to 10 (5-6 notable, 7-8 significant, 9-10 life-altering); never below 5
- tags: one to three short retrieval tags
An empty list is a good answer when nothing lasting was said."""

CONTRADICTION = """\
You compare a NEW memory with numbered EXISTING memories. An existing memory is contradicted \
when the new one directly updates, corrects or overrides it (a changed preference, an updated \
fact). Memories that merely differ, add detail or talk about something else are compatible.

Answer with JSON only: {"verdicts": [{"existing": N, "contradicts": true or false}, ...]} with \
one verdict for every existing memory, and nothing else."""


def email_system_prompt(preferences: Sequence[tuple[str, str]]) -> str:
    """The email triage prompt, followed by the user's stated preferences when there are any."""
    if not preferences:
        return EMAIL_TRIAGE
    lines = "\n".join(f"- {key}: {value}" for key, value in preferences)
    return f"{EMAIL_TRIAGE}\n\n{PREFERENCES_INTRO}\n{lines}"


def coverage_note(count: int) -> str:
    """The nudge appended to a triage input that resembles several live memories."""
    return (
        f"[Note: {count} similar memories already exist. Save this only if it is genuinely new "
        "information.]"
    )


def contradiction_input(new_summary: str, existing: Sequence[str]) -> str:
    """``NEW: …`` then ``EXISTING_i: …`` lines, numbered from 1."""
    lines = [f"NEW: {new_summary}"]
    lines += [f"EXISTING_{i}: {text}" for i, text in enumerate(existing, start=1)]
    return "\n".join(lines)
