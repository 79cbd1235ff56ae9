/* page: the web page served at `/` (services/gateway/www/index.html), built into the program so that
 * serving it reads no file and follows no path. */
#ifndef GW_PAGE_H
#define GW_PAGE_H

#include <stddef.h>

/* The page's bytes [*len] (static, read-only). */
const char *gw_page(size_t *len);

#endif
