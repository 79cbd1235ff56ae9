/* test_qa: MuSiQue helpers: normalization and F1 against values computed with the anchors' Python
 * normalize_answer (tests list them), answer extraction, prompt strings, jsonl validation, and the
 * real data file (100 examples x 10 passages). */
#include "rag/qa.h"
#include "rag/ragprompt.h"
#include "test.h"

#include <unistd.h>

static int str_is(char *got, const char *want) { /* frees got */
    int ok = got && strcmp(got, want) == 0;
    if (!ok) fprintf(stderr, "  got [%s], want [%s]\n", got ? got : "(null)", want);
    free(got);
    return ok;
}

/* Expected values from Python: re.sub(r"\b(a|an|the)\b", " ", ...), string.punctuation, str.lower/split. */
TEST(test_normalize) {
    CHECK(str_is(cb_qa_normalize("The Charles County"), "charles county"));
    CHECK(str_is(cb_qa_normalize(""), ""));
    CHECK(str_is(cb_qa_normalize(NULL), ""));
    CHECK(str_is(cb_qa_normalize("the"), ""));
    CHECK(str_is(cb_qa_normalize("Charles-County!"), "charlescounty"));
    CHECK(str_is(cb_qa_normalize("U.S.A."), "usa"));
    CHECK(str_is(cb_qa_normalize("ÉCOLE Normale"), "école normale"));
    CHECK(str_is(cb_qa_normalize("£5 million"), "£5 million"));
    CHECK(str_is(cb_qa_normalize("theory of the mind"), "theory of mind"));
    CHECK(str_is(cb_qa_normalize("1914–1918 a–b"), "1914–1918 –b")); /* en dash: not punctuation, a word boundary */
    CHECK(str_is(cb_qa_normalize("  Charles\t\nCounty  "), "charles county"));
    CHECK(str_is(cb_qa_normalize("Anne and Theodore"), "anne and theodore"));
    CHECK(str_is(cb_qa_normalize("x_y the_z"), "xy thez"));
    CHECK(str_is(cb_qa_normalize("Straße"), "straße"));
    CHECK(str_is(cb_qa_normalize("An a THE then"), "then"));
    /* invalid UTF-8 becomes U+FFFD (a word character for the split, as in Python) */
    CHECK(str_is(cb_qa_normalize("ab\xff" "CD the"), "ab\xEF\xBF\xBD" "cd"));
    CHECK(str_is(cb_qa_normalize("Br\xC3"), "br\xEF\xBF\xBD"));           /* cut inside "é" */
    CHECK(str_is(cb_qa_normalize("\xED\xA0\x80 x"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD x")); /* surrogate */
}

TEST(test_f1) {
    CHECK_NEAR(cb_qa_f1("The Charles County", "Charles County"), 1.0, 1e-9);
    CHECK_NEAR(cb_qa_f1("Charles", "Charles County"), 2.0 / 3.0, 1e-9);
    CHECK_NEAR(cb_qa_f1("", ""), 1.0, 1e-9);
    CHECK_NEAR(cb_qa_f1("", "x"), 0.0, 1e-9);
    CHECK_NEAR(cb_qa_f1("x", ""), 0.0, 1e-9);
    CHECK_NEAR(cb_qa_f1(NULL, NULL), 1.0, 1e-9);
    CHECK_NEAR(cb_qa_f1("the", "a"), 1.0, 1e-9); /* both empty after normalization */
    CHECK_NEAR(cb_qa_f1("Charles-County!", "charles county"), 0.0, 1e-9);
    CHECK_NEAR(cb_qa_f1("U.S.A.", "usa"), 1.0, 1e-9);
    CHECK_NEAR(cb_qa_f1("ÉCOLE Normale", "école normale"), 1.0, 1e-9);
    CHECK_NEAR(cb_qa_f1("£5 million", "5 million"), 0.5, 1e-9);
    CHECK_NEAR(cb_qa_f1("an apple a day", "apple day"), 1.0, 1e-9);
    CHECK_NEAR(cb_qa_f1("1914–1918 a–b", "a–b"), 2.0 / 3.0, 1e-9);
    CHECK_NEAR(cb_qa_f1("the the cat cat", "cat"), 2.0 / 3.0, 1e-9); /* multiset: one common */
    CHECK_NEAR(cb_qa_f1("Anne and Theodore", "anne theodore"), 0.8, 1e-9);
    CHECK_NEAR(cb_qa_f1("county charles", "Charles County"), 1.0, 1e-9); /* order-free */
    const char *answers[] = {"Charles County", "Charles", "Maryland"};
    CHECK_NEAR(cb_qa_f1_best("Charles", answers, 3), 1.0, 1e-9);
    CHECK_NEAR(cb_qa_f1_best("Hughesville, Maryland", answers, 3), 2.0 / 3.0, 1e-9);
    CHECK_NEAR(cb_qa_f1_best("x", answers, 0), 0.0, 1e-9);
    CHECK_NEAR(cb_qa_f1_best("x", NULL, 3), 0.0, 1e-9);
    /* token-id F1 (the anchors' exact metric) */
    int32_t p[] = {5, 7, 7, 9}, g[] = {7, 9, 11};
    CHECK_NEAR(cb_qa_f1_ids(p, 4, g, 3), 2 * (2.0 / 4) * (2.0 / 3) / (2.0 / 4 + 2.0 / 3), 1e-9);
    CHECK_NEAR(cb_qa_f1_ids(p, 0, g, 0), 1.0, 1e-9);
    CHECK_NEAR(cb_qa_f1_ids(NULL, 0, g, 3), 0.0, 1e-9);
    CHECK_NEAR(cb_qa_f1_ids(p, 1, g, 3), 0.0, 1e-9);
}

TEST(test_answer_extraction) {
    CHECK(str_is(cb_qa_first_line("\n\nCharles County\nmore text"), "Charles County"));
    CHECK(str_is(cb_qa_first_line(" Charles County"), " Charles County"));
    CHECK(str_is(cb_qa_first_line(""), ""));
    CHECK(str_is(cb_qa_first_line("\n\n\n"), ""));
    CHECK(str_is(cb_qa_first_line(NULL), ""));
    CHECK(str_is(cb_qa_parse_generation("\nyes, it is\nbecause"), "Yes"));
    CHECK(str_is(cb_qa_parse_generation("Yesterday"), "Yes"));  /* the anchors' prefix test, sic */
    CHECK(str_is(cb_qa_parse_generation("  no way"), "No"));
    CHECK(str_is(cb_qa_parse_generation("Norway"), "No"));      /* sic */
    CHECK(str_is(cb_qa_parse_generation("The answer is no"), "The answer is no"));
    CHECK(str_is(cb_qa_parse_generation("N"), "N"));
    CHECK(str_is(cb_qa_parse_generation(""), ""));
    const char *answers[] = {"Charles County"};
    CHECK_NEAR(cb_qa_score("\nCharles County, Maryland\nQuestion: ...", answers, 1), 0.8, 1e-9);
    CHECK_NEAR(cb_qa_score("Nothing", answers, 1), 0.0, 1e-9);
}

TEST(test_prompt_pieces) {
    /* The anchors' strings (example/blend_musique.py), byte for byte. */
    CHECK(!strcmp(cb_ragprompt_instruction(),
                  "You will be asked a question after reading several passages. Please directly answer the question "
                  "based on the given passages. Do NOT repeat the question. The answer should be within 5 words..\n"
                  "Passages:\n"));
    CHECK(str_is(cb_ragprompt_chunk_text("", "some text"), "\n\nsome text\n\n"));
    CHECK(str_is(cb_ragprompt_chunk_text("Title", "T"), "Title\n\nT\n\n"));
    CHECK(str_is(cb_ragprompt_chunk_text(NULL, NULL), "\n\n\n\n"));
    CHECK(str_is(cb_ragprompt_normalize_question("Who is X?"), "who is X?"));
    CHECK(str_is(cb_ragprompt_normalize_question("Where"), "where?"));
    CHECK(str_is(cb_ragprompt_normalize_question("Élan?"), "élan?"));
    CHECK(str_is(cb_ragprompt_normalize_question(""), "?"));
    CHECK(str_is(cb_ragprompt_question("Who is the child of the Victim of Romance performer?"),
                 "\n\nAnswer the question directly based on the given passages. Do NOT repeat the question. The "
                 "answer should be within 5 words. \nQuestion:who is the child of the Victim of Romance performer?"
                 "\nAnswer:"));
}

static int parse_fails(const char *line, const char *want_in_err) {
    char err[256] = "";
    cb_qa_example_t *ex = cb_qa_example_parse(line, strlen(line), err, sizeof err);
    if (ex) {
        cb_qa_example_destroy(&ex);
        fprintf(stderr, "  accepted: %s\n", line);
        return 0;
    }
    if (!strstr(err, want_in_err)) {
        fprintf(stderr, "  error [%s] lacks [%s]\n", err, want_in_err);
        return 0;
    }
    return 1;
}

TEST(test_parse_validation) {
    const char *good = "{\"id\":\"m-1\",\"question\":\"Q?\",\"answers\":[\"A\",\"B b\"],"
                       "\"ctxs\":[{\"title\":\"\",\"text\":\"t1\"},{\"title\":\"T\",\"text\":\"t2\"}],\"extra\":1}";
    char err[256];
    cb_qa_example_t *ex = cb_qa_example_parse(good, strlen(good), err, sizeof err);
    CHECK_MSG(ex != NULL, "%s", err);
    CHECK(!strcmp(ex->id, "m-1") && !strcmp(ex->question, "Q?") && ex->n_answers == 2 &&
          !strcmp(ex->answers[1], "B b") && ex->n_ctxs == 2 && !strcmp(ex->ctxs[0].title, "") &&
          !strcmp(ex->ctxs[1].text, "t2"));
    cb_qa_example_destroy(&ex);
    CHECK(ex == NULL);
    cb_qa_example_destroy(&ex);
    /* a line need not be NUL-terminated: parse a prefix of a longer buffer */
    char buf[512];
    snprintf(buf, sizeof buf, "%sGARBAGE", good);
    ex = cb_qa_example_parse(buf, strlen(good), err, sizeof err);
    CHECK(ex != NULL);
    cb_qa_example_destroy(&ex);
    CHECK(parse_fails("not json", "bad JSON"));
    CHECK(parse_fails("", "bad JSON"));
    CHECK(parse_fails("[1,2]", "not a JSON object"));
    CHECK(parse_fails(buf, "bad JSON")); /* trailing garbage */
    CHECK(parse_fails("{\"question\":\"q\",\"answers\":[\"a\"],\"ctxs\":[{\"title\":\"\",\"text\":\"t\"}]}", "id: missing"));
    CHECK(parse_fails("{\"id\":\"\",\"question\":\"q\",\"answers\":[\"a\"],\"ctxs\":[{\"title\":\"\",\"text\":\"t\"}]}", "id: empty"));
    CHECK(parse_fails("{\"id\":7,\"question\":\"q\",\"answers\":[\"a\"],\"ctxs\":[{\"title\":\"\",\"text\":\"t\"}]}", "id: not a string"));
    CHECK(parse_fails("{\"id\":\"x\",\"answers\":[\"a\"],\"ctxs\":[{\"title\":\"\",\"text\":\"t\"}]}", "question: missing"));
    CHECK(parse_fails("{\"id\":\"x\",\"question\":\"q\",\"answers\":[],\"ctxs\":[{\"title\":\"\",\"text\":\"t\"}]}", "answers: needs"));
    CHECK(parse_fails("{\"id\":\"x\",\"question\":\"q\",\"answers\":\"a\",\"ctxs\":[{\"title\":\"\",\"text\":\"t\"}]}", "answers: not an array"));
    CHECK(parse_fails("{\"id\":\"x\",\"question\":\"q\",\"answers\":[\"a\",3],\"ctxs\":[{\"title\":\"\",\"text\":\"t\"}]}", "answers[1]: not a string"));
    CHECK(parse_fails("{\"id\":\"x\",\"question\":\"q\",\"answers\":[\"\"],\"ctxs\":[{\"title\":\"\",\"text\":\"t\"}]}", "answers[0]: empty"));
    CHECK(parse_fails("{\"id\":\"x\",\"question\":\"q\",\"answers\":[\"a\"]}", "ctxs: missing"));
    CHECK(parse_fails("{\"id\":\"x\",\"question\":\"q\",\"answers\":[\"a\"],\"ctxs\":[]}", "ctxs: needs"));
    CHECK(parse_fails("{\"id\":\"x\",\"question\":\"q\",\"answers\":[\"a\"],\"ctxs\":[\"t\"]}", "ctxs[0]: not an object"));
    CHECK(parse_fails("{\"id\":\"x\",\"question\":\"q\",\"answers\":[\"a\"],\"ctxs\":[{\"title\":\"\",\"text\":\"t\"},{\"title\":\"\"}]}", "ctxs[1].text: missing"));
    CHECK(parse_fails("{\"id\":\"x\",\"question\":\"q\",\"answers\":[\"a\"],\"ctxs\":[{\"title\":null,\"text\":\"t\"}]}", "ctxs[0].title: not a string"));
    CHECK(parse_fails("{\"id\":\"x\",\"id\":\"y\",\"question\":\"q\",\"answers\":[\"a\"],\"ctxs\":[{\"title\":\"\",\"text\":\"t\"}]}", "bad JSON"));
    CHECK(parse_fails("{\"id\":\"x\\u0000y\",\"question\":\"q\",\"answers\":[\"a\"],\"ctxs\":[{\"title\":\"\",\"text\":\"t\"}]}", "bad JSON"));
    CHECK(parse_fails("{\"id\":\"\xff\",\"question\":\"q\",\"answers\":[\"a\"],\"ctxs\":[{\"title\":\"\",\"text\":\"t\"}]}", "bad JSON"));
    CHECK(cb_qa_example_parse(NULL, 0, err, sizeof err) == NULL);
}

TEST(test_load_errors) {
    char err[256];
    CHECK(cb_qa_set_load("/nonexistent/x.jsonl", err, sizeof err) == NULL && strstr(err, "cannot open"));
    char path[] = "/tmp/test_qa.XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    const char *content =
        "{\"id\":\"a\",\"question\":\"q\",\"answers\":[\"x\"],\"ctxs\":[{\"title\":\"\",\"text\":\"t\"}]}\n"
        "\n"
        "{\"id\":\"b\",\"question\":\"q\",\"answers\":[\"x\"],\"ctxs\":[{\"title\":\"\",\"text\":5}]}\n";
    CHECK(write(fd, content, strlen(content)) == (ssize_t)strlen(content));
    close(fd);
    cb_qa_set_t *s = cb_qa_set_load(path, err, sizeof err);
    CHECK_MSG(s == NULL && strstr(err, ":3: ctxs[0].text: not a string"), "%s", err);
    /* blank lines and a missing final newline are fine */
    FILE *f = fopen(path, "w");
    fputs("\n{\"id\":\"a\",\"question\":\"q\",\"answers\":[\"x\"],\"ctxs\":[{\"title\":\"\",\"text\":\"t\"}]}\r\n  \n"
          "{\"id\":\"b\",\"question\":\"q\",\"answers\":[\"x\"],\"ctxs\":[{\"title\":\"\",\"text\":\"t\"}]}", f);
    fclose(f);
    s = cb_qa_set_load(path, err, sizeof err);
    CHECK_MSG(s != NULL, "%s", err);
    CHECK(cb_qa_set_size(s) == 2 && !strcmp(cb_qa_set_get(s, 1)->id, "b") && cb_qa_set_get(s, 2) == NULL &&
          cb_qa_set_get(s, -1) == NULL);
    cb_qa_set_destroy(&s);
    CHECK(s == NULL);
    unlink(path);
}

TEST(test_real_file) {
    const char *path = "data/musique_dev.jsonl";
    if (access(path, R_OK) != 0) SKIP("data/musique_dev.jsonl not found (run from the repository root)");
    char err[256];
    cb_qa_set_t *s = cb_qa_set_load(path, err, sizeof err);
    CHECK_MSG(s != NULL, "%s", err);
    CHECK(cb_qa_set_size(s) == 100);
    for (int i = 0; i < cb_qa_set_size(s); i++) {
        const cb_qa_example_t *ex = cb_qa_set_get(s, i);
        CHECK_MSG(ex->n_ctxs == 10, "example %d has %d ctxs", i, ex->n_ctxs);
        CHECK(ex->n_answers >= 1 && strlen(ex->question) > 0);
    }
    const cb_qa_example_t *ex = cb_qa_set_get(s, 0);
    CHECK(!strcmp(ex->id, "musique-001"));
    CHECK(!strcmp(ex->question, "In which county is Southern Maryland Electric Cooperative headquartered?"));
    CHECK(!strcmp(ex->answers[0], "Charles County"));
    char *chunk = cb_ragprompt_chunk_text(ex->ctxs[0].title, ex->ctxs[0].text);
    CHECK(!strncmp(chunk, "\n\ndistrict, champasak province", 30));
    free(chunk);
    const char *const *ans = (const char *const *)ex->answers;
    CHECK_NEAR(cb_qa_score("Charles County.\n", ans, ex->n_answers), 1.0, 1e-9);
    cb_qa_set_destroy(&s);
}

int main(void) {
    RUN(test_normalize);
    RUN(test_f1);
    RUN(test_answer_extraction);
    RUN(test_prompt_pieces);
    RUN(test_parse_validation);
    RUN(test_load_errors);
    RUN(test_real_file);
    return test_summary();
}
