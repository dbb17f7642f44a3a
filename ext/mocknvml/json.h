/* Small JSON (RFC 8259) DOM parser for the mock NVML profiles. No dependencies beyond libc. */
#ifndef MOCKNVML_JSON_H
#define MOCKNVML_JSON_H

#include <stddef.h>

typedef enum { JSON_NULL, JSON_BOOL, JSON_INT, JSON_REAL, JSON_STRING, JSON_ARRAY, JSON_OBJECT } json_type;

typedef struct json_value {
    json_type type;
    int line, col;          /* where the value starts, 1-based */
    long long i;            /* JSON_INT and JSON_BOOL (0/1) */
    double d;               /* JSON_REAL (and JSON_INT converted) */
    char *s;                /* JSON_STRING, NUL-terminated UTF-8 (embedded NULs rejected) */
    size_t n;               /* number of items / members */
    struct json_value *items; /* JSON_ARRAY items, JSON_OBJECT member values */
    char **keys;            /* JSON_OBJECT member names */
} json_value;

/* Parse text[0..len). Returns a heap tree or NULL with a message "line:col: what" in err. */
json_value *json_parse(const char *text, size_t len, char *err, size_t errlen);
void json_free(json_value *v);
/* Member of an object by name (the last one wins on duplicates), or NULL. */
const json_value *json_get(const json_value *obj, const char *key);

#endif
