// Progressive enhancement only: the pages work without it. Every N seconds (data-refresh on
// <main>), fetch the same URL's content fragment and swap it in, unless the reader is typing
// in a form or the tab is hidden. The server escapes everything it sends.
(function () {
  "use strict";
  var main = document.getElementById("content");
  if (!main || !window.fetch) { return; }
  var seconds = parseInt(main.getAttribute("data-refresh") || "0", 10);
  if (!(seconds > 0)) { return; }
  function busy() {
    var el = document.activeElement;
    return el && main.contains(el) && /^(INPUT|SELECT|TEXTAREA|BUTTON)$/.test(el.tagName);
  }
  function refresh() {
    if (document.hidden || busy()) { return; }
    fetch(window.location.href, {
      headers: { "X-Sdcore-Fragment": "1" }, credentials: "same-origin", cache: "no-store"
    }).then(function (response) {
      if (!response.ok) { throw new Error(String(response.status)); }
      return response.text();
    }).then(function (html) {
      if (!busy()) {
        main.innerHTML = html;
        main.setAttribute("data-refreshed", new Date().toISOString());
      }
    }).catch(function () { /* keep the last good page; the next round tries again */ });
  }
  window.setInterval(refresh, seconds * 1000);
}());
