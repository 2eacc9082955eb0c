// Starts the page's view: the Content-Security-Policy allows no inline script.
(function () {
  var page = document.currentScript.getAttribute("data-page");
  if (page === "jobs") startJobList();
  else if (page === "job") startJobPage();
})();
