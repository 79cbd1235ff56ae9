/* page: the web page, embedded with the assembler's .incbin (the path is relative to the directory make
 * runs in: the repository root). See page.h. */
#include "page.h"

__asm__(".section .rodata\n"
        ".balign 16\n"
        "gw_page_start:\n"
        ".incbin \"services/gateway/www/index.html\"\n"
        "gw_page_end:\n"
        ".byte 0\n"
        ".previous\n");

extern const char gw_page_start[], gw_page_end[];

const char *gw_page(size_t *len) {
    *len = (size_t)(gw_page_end - gw_page_start);
    return gw_page_start;
}
