/* Recursive-descent JSON parser: strict RFC 8259 grammar, nesting limited to JSON_MAX_DEPTH, \u escapes
 * (with surrogate pairs) decoded to UTF-8, integers kept exact in a long long when they fit. */
#include "json.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define JSON_MAX_DEPTH 64

typedef struct {
    const char *p, *end;
    int line, col;
    char *err;
    size_t errlen;
    int failed;
} parser;

static void fail(parser *ps, const char *fmt, ...) {
    if (ps->failed) return;
    ps->failed = 1;
    int k = snprintf(ps->err, ps->errlen, "%d:%d: ", ps->line, ps->col);
    if (k < 0 || (size_t)k >= ps->errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ps->err + k, ps->errlen - (size_t)k, fmt, ap);
    va_end(ap);
}

static void advance(parser *ps) {
    if (*ps->p == '\n') { ps->line++; ps->col = 1; } else { ps->col++; }
    ps->p++;
}

static void skip_ws(parser *ps) {
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r')) advance(ps);
}

static int parse_value(parser *ps, json_value *out, int depth);

static int literal(parser *ps, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(ps->end - ps->p) < n || memcmp(ps->p, word, n) != 0) {
        fail(ps, "invalid literal (expected '%s')", word);
        return 0;
    }
    for (size_t k = 0; k < n; k++) advance(ps);
    return 1;
}

static int hex4(parser *ps, unsigned *cp) {
    *cp = 0;
    for (int k = 0; k < 4; k++) {
        if (ps->p >= ps->end) { fail(ps, "truncated \\u escape"); return 0; }
        char c = *ps->p;
        unsigned v;
        if (c >= '0' && c <= '9') v = (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v = (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v = (unsigned)(c - 'A' + 10);
        else { fail(ps, "bad hex digit in \\u escape"); return 0; }
        *cp = (*cp << 4) | v;
        advance(ps);
    }
    return 1;
}

static void put_utf8(char *buf, size_t *n, unsigned cp) {
    if (cp < 0x80) buf[(*n)++] = (char)cp;
    else if (cp < 0x800) { buf[(*n)++] = (char)(0xC0 | (cp >> 6)); buf[(*n)++] = (char)(0x80 | (cp & 0x3F)); }
    else if (cp < 0x10000) {
        buf[(*n)++] = (char)(0xE0 | (cp >> 12)); buf[(*n)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        buf[(*n)++] = (char)(0x80 | (cp & 0x3F));
    } else {
        buf[(*n)++] = (char)(0xF0 | (cp >> 18)); buf[(*n)++] = (char)(0x80 | ((cp >> 12) & 0x3F));
        buf[(*n)++] = (char)(0x80 | ((cp >> 6) & 0x3F)); buf[(*n)++] = (char)(0x80 | (cp & 0x3F));
    }
}

static char *parse_string_raw(parser *ps) {
    /* at opening quote; output is never longer than the input span */
    advance(ps);
    const char *start = ps->p;
    size_t cap = 16;
    for (const char *q = start; q < ps->end && *q != '"'; q++) { cap++; if (*q == '\\') q++; }
    char *buf = malloc(cap + 8);
    if (!buf) { fail(ps, "out of memory"); return NULL; }
    size_t n = 0;
    for (;;) {
        if (ps->p >= ps->end) { fail(ps, "unterminated string"); free(buf); return NULL; }
        unsigned char c = (unsigned char)*ps->p;
        if (c == '"') { advance(ps); break; }
        if (c < 0x20) { fail(ps, "control character in string"); free(buf); return NULL; }
        if (c != '\\') { buf[n++] = (char)c; advance(ps); continue; }
        advance(ps);
        if (ps->p >= ps->end) { fail(ps, "unterminated escape"); free(buf); return NULL; }
        char e = *ps->p;
        advance(ps);
        switch (e) {
        case '"': buf[n++] = '"'; break;
        case '\\': buf[n++] = '\\'; break;
        case '/': buf[n++] = '/'; break;
        case 'b': buf[n++] = '\b'; break;
        case 'f': buf[n++] = '\f'; break;
        case 'n': buf[n++] = '\n'; break;
        case 'r': buf[n++] = '\r'; break;
        case 't': buf[n++] = '\t'; break;
        case 'u': {
            unsigned cp;
            if (!hex4(ps, &cp)) { free(buf); return NULL; }
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                unsigned lo;
                if (ps->end - ps->p < 2 || ps->p[0] != '\\' || ps->p[1] != 'u') {
                    fail(ps, "unpaired surrogate in \\u escape"); free(buf); return NULL;
                }
                advance(ps); advance(ps);
                if (!hex4(ps, &lo)) { free(buf); return NULL; }
                if (lo < 0xDC00 || lo > 0xDFFF) { fail(ps, "bad low surrogate"); free(buf); return NULL; }
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                fail(ps, "unpaired surrogate in \\u escape"); free(buf); return NULL;
            }
            if (cp == 0) { fail(ps, "NUL character in string"); free(buf); return NULL; }
            put_utf8(buf, &n, cp);
            break;
        }
        default: fail(ps, "invalid escape '\\%c'", e); free(buf); return NULL;
        }
    }
    buf[n] = '\0';
    return buf;
}

static int parse_number(parser *ps, json_value *out) {
    const char *s = ps->p;
    const char *q = s;
    int is_int = 1;
    if (q < ps->end && *q == '-') q++;
    if (q >= ps->end || !(*q >= '0' && *q <= '9')) { fail(ps, "invalid number"); return 0; }
    if (*q == '0') { q++; if (q < ps->end && *q >= '0' && *q <= '9') { fail(ps, "leading zero in number"); return 0; } }
    else while (q < ps->end && *q >= '0' && *q <= '9') q++;
    if (q < ps->end && *q == '.') {
        is_int = 0; q++;
        if (q >= ps->end || !(*q >= '0' && *q <= '9')) { fail(ps, "digit expected after '.'"); return 0; }
        while (q < ps->end && *q >= '0' && *q <= '9') q++;
    }
    if (q < ps->end && (*q == 'e' || *q == 'E')) {
        is_int = 0; q++;
        if (q < ps->end && (*q == '+' || *q == '-')) q++;
        if (q >= ps->end || !(*q >= '0' && *q <= '9')) { fail(ps, "digit expected in exponent"); return 0; }
        while (q < ps->end && *q >= '0' && *q <= '9') q++;
    }
    size_t len = (size_t)(q - s);
    char tmp[64];
    if (len >= sizeof tmp) { fail(ps, "number too long"); return 0; }
    memcpy(tmp, s, len);
    tmp[len] = '\0';
    errno = 0;
    if (is_int) {
        long long v = strtoll(tmp, NULL, 10);
        if (errno == ERANGE) { fail(ps, "integer out of range"); return 0; }
        out->type = JSON_INT; out->i = v; out->d = (double)v;
    } else {
        out->type = JSON_REAL; out->d = strtod(tmp, NULL); out->i = (long long)out->d;
    }
    while (ps->p < q) advance(ps);
    return 1;
}

static int grow(parser *ps, json_value **items, char ***keys, size_t n, size_t *cap) {
    if (n < *cap) return 1;
    size_t nc = *cap ? *cap * 2 : 8;
    json_value *ni = realloc(*items, nc * sizeof **items);
    if (!ni) { fail(ps, "out of memory"); return 0; }
    *items = ni;
    if (keys) {
        char **nk = realloc(*keys, nc * sizeof **keys);
        if (!nk) { fail(ps, "out of memory"); return 0; }
        *keys = nk;
    }
    *cap = nc;
    return 1;
}

static void free_children(json_value *v);

static int parse_array(parser *ps, json_value *out, int depth) {
    size_t cap = 0;
    out->type = JSON_ARRAY;
    advance(ps);
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == ']') { advance(ps); return 1; }
    for (;;) {
        if (!grow(ps, &out->items, NULL, out->n, &cap)) return 0;
        memset(&out->items[out->n], 0, sizeof out->items[0]);
        out->n++;
        if (!parse_value(ps, &out->items[out->n - 1], depth + 1)) return 0;
        skip_ws(ps);
        if (ps->p >= ps->end) { fail(ps, "unterminated array"); return 0; }
        if (*ps->p == ',') { advance(ps); continue; }
        if (*ps->p == ']') { advance(ps); return 1; }
        fail(ps, "expected ',' or ']' in array");
        return 0;
    }
}

static int parse_object(parser *ps, json_value *out, int depth) {
    size_t cap = 0;
    out->type = JSON_OBJECT;
    advance(ps);
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == '}') { advance(ps); return 1; }
    for (;;) {
        skip_ws(ps);
        if (ps->p >= ps->end) { fail(ps, "unexpected end of input (unterminated object)"); return 0; }
        if (*ps->p != '"') { fail(ps, "expected a member name in double quotes"); return 0; }
        if (!grow(ps, &out->items, &out->keys, out->n, &cap)) return 0;
        char *key = parse_string_raw(ps);
        if (!key) return 0;
        out->keys[out->n] = key;
        memset(&out->items[out->n], 0, sizeof out->items[0]);
        out->n++;
        skip_ws(ps);
        if (ps->p >= ps->end || *ps->p != ':') { fail(ps, "expected ':' after member name"); return 0; }
        advance(ps);
        if (!parse_value(ps, &out->items[out->n - 1], depth + 1)) return 0;
        skip_ws(ps);
        if (ps->p >= ps->end) { fail(ps, "unterminated object"); return 0; }
        if (*ps->p == ',') { advance(ps); continue; }
        if (*ps->p == '}') { advance(ps); return 1; }
        fail(ps, "expected ',' or '}' in object");
        return 0;
    }
}

static int parse_value(parser *ps, json_value *out, int depth) {
    if (depth > JSON_MAX_DEPTH) { fail(ps, "nesting deeper than %d", JSON_MAX_DEPTH); return 0; }
    skip_ws(ps);
    out->line = ps->line;
    out->col = ps->col;
    if (ps->p >= ps->end) { fail(ps, "unexpected end of input"); return 0; }
    switch (*ps->p) {
    case '{': return parse_object(ps, out, depth);
    case '[': return parse_array(ps, out, depth);
    case '"': out->type = JSON_STRING; out->s = parse_string_raw(ps); return out->s != NULL;
    case 't': out->type = JSON_BOOL; out->i = 1; return literal(ps, "true");
    case 'f': out->type = JSON_BOOL; out->i = 0; return literal(ps, "false");
    case 'n': out->type = JSON_NULL; return literal(ps, "null");
    default:
        if (*ps->p == '-' || (*ps->p >= '0' && *ps->p <= '9')) return parse_number(ps, out);
        fail(ps, "unexpected character '%c'", *ps->p);
        return 0;
    }
}

static void free_children(json_value *v) {
    if (!v) return;
    for (size_t k = 0; k < v->n; k++) {
        if (v->items) free_children(&v->items[k]);
        if (v->keys) free(v->keys[k]);
    }
    free(v->items);
    free(v->keys);
    free(v->s);
}

json_value *json_parse(const char *text, size_t len, char *err, size_t errlen) {
    parser ps = {text, text + len, 1, 1, err, errlen, 0};
    if (errlen) err[0] = '\0';
    json_value *root = calloc(1, sizeof *root);
    if (!root) { snprintf(err, errlen, "out of memory"); return NULL; }
    if (len >= 3 && (unsigned char)text[0] == 0xEF && (unsigned char)text[1] == 0xBB && (unsigned char)text[2] == 0xBF)
        ps.p += 3;
    if (parse_value(&ps, root, 0)) {
        skip_ws(&ps);
        if (ps.p < ps.end) fail(&ps, "trailing characters after the JSON value");
    }
    if (ps.failed) { free_children(root); free(root); return NULL; }
    return root;
}

void json_free(json_value *v) {
    if (!v) return;
    free_children(v);
    free(v);
}

const json_value *json_get(const json_value *obj, const char *key) {
    if (!obj || obj->type != JSON_OBJECT) return NULL;
    for (size_t k = obj->n; k-- > 0;)
        if (strcmp(obj->keys[k], key) == 0) return &obj->items[k];
    return NULL;
}
